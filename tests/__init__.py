"""A package, so that the tests' tiny task (tests/tiny_task.py) is `tests.tiny_task` for the side by side too
(benchmark/openai/side_by_side.py) and the tests import their shared helpers as `tests.conftest`."""
