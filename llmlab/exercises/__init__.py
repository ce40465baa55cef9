"""Exercise notebooks: one source in solutions/, generated exercises/, and a grader.

- :mod:`llmlab.exercises.notebooks`: ``llmlab exercises build|check``, writing exercises/ from solutions/;
- :mod:`llmlab.exercises.grade`: ``llmlab grade NOTEBOOK``, executing a notebook and reporting each exercise.

The checks each exercise's check cell calls live in :mod:`llmlab.checks` (one module per chapter).
Nothing is imported here, so ``import llmlab.exercises`` stays cheap.
"""
