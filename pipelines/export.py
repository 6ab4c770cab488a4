"""Stage `export`: see `specdistill.stages.export`. `python pipelines/export.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.export import run

if __name__ == "__main__":
    stage_main(run)
