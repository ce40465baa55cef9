"""Exercises that grade themselves: one source in solutions/, generated exercises/, checks and a grader.

- :mod:`llmlab.exercises.notebooks`: ``llmlab exercises build|check``, writing exercises/ from solutions/;
- :mod:`llmlab.exercises.checks`: the checker base every chapter's checks (``llmlab.exercises.chNN``) use;
- :mod:`llmlab.exercises.grade`: ``llmlab grade NOTEBOOK``, executing a notebook and reporting each exercise.

Nothing is imported here, so ``import llmlab.exercises`` stays cheap (the checks import torch).
"""
