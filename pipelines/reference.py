"""Stage `reference`: see `specdistill.stages.reference`. `python pipelines/reference.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.reference import run

if __name__ == "__main__":
    stage_main(run)
