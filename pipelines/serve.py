"""Stage `serve`: see `specdistill.stages.serve`. `python pipelines/serve.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.serve import run

if __name__ == "__main__":
    stage_main(run)
