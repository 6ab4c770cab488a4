"""Stage `prepare`: see `specdistill.stages.prepare`. `python pipelines/prepare.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.prepare import run

if __name__ == "__main__":
    stage_main(run)
