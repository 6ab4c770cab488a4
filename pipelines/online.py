"""Stage `online`: see `specdistill.stages.online`. `python pipelines/online.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.online import run

if __name__ == "__main__":
    stage_main(run)
