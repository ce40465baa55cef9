"""Exercise notebooks: one source in solutions/, generated exercises/, and a grader.

- :mod:`llmlab.exercises.notebooks`: ``llmlab exercises build|check``, writing exercises/ from solutions/;
- :mod:`llmlab.exercises.official`: a chapter's exercises and their official checks, read from its solution;
- :mod:`llmlab.exercises.grade`: ``llmlab grade NOTEBOOK``, running a notebook against those checks;
- :mod:`llmlab.exercises.sandbox`: what bounds the graded kernel (its processes, memory, and ``--isolate``).

The checks each exercise's check cell calls live in :mod:`llmlab.checks` (one module per chapter).
Nothing is imported here, so ``import llmlab.exercises`` stays cheap.
"""
