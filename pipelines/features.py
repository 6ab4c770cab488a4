"""Stage `features`: see `specdistill.stages.features`. `python pipelines/features.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.features import run

if __name__ == "__main__":
    stage_main(run)
