"""Stage `report`: see `specdistill.stages.report`. `python pipelines/report.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.report import run

if __name__ == "__main__":
    stage_main(run)
