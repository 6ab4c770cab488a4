"""Stage `online_engine`: see `specdistill.stages.online_engine`. `python pipelines/online_engine.py --help` lists the
config."""

from _entry import stage_main

from specdistill.stages.online_engine import run

if __name__ == "__main__":
    stage_main(run)
