"""The offline demo: the embedded model (`tilellm.assets`) answering checkable problems.

`task` defines the problems and their train / held-out split; `runner` drives the engine step by
step and prints what each step did.
"""

from tilellm.demo.runner import DemoResult, StepLine, run_demo
from tilellm.demo.task import PREFIX, Problem, held_out_problems

__all__ = ["DemoResult", "PREFIX", "Problem", "StepLine", "held_out_problems", "run_demo"]
