"""Run the pipeline on a GPU host without internet whose commands are cut after a while (see README.md):
`bundle` carries files in pieces both ways, `carry` says what (wheels here -> there; DVC's run-cache
and a checkpoint there -> here -> the next host), `runner` runs `dvc repro` and DVC experiments
under a budget, `report` gathers a run's figures."""
