"""Experiments: one file's stages over its axes (`spml-cache run EXPERIMENT.toml`, docs/experiments.md), each step
the command a user would type, resumed and reused like a run.

Not a stage: like the demo it stands above the stages and calls each one's door in turn. `file.py` reads the file
(with `positions.py`, each key's line), `stages.py` says what each stage's table takes and how its command reads,
`plan.py` and `checks.py` make and check the steps before anything runs, `state.py` keeps what each step made,
`run.py` runs them. Nothing is imported here, so that `spml-cache run --help` does not pay for the stages' imports.
"""
