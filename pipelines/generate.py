"""Stage `generate`: see `specdistill.stages.generate`. `python pipelines/generate.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.generate import run

if __name__ == "__main__":
    stage_main(run)
