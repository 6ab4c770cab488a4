"""Stage `evaluate`: see `specdistill.stages.evaluate`. `python pipelines/evaluate.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.evaluate import run

if __name__ == "__main__":
    stage_main(run)
