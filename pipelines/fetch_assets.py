"""Stage `fetch_assets`: see `specdistill.stages.fetch_assets`. \
`python pipelines/fetch_assets.py --help` lists the config."""

from _entry import stage_main

from specdistill.stages.fetch_assets import run

if __name__ == "__main__":
    stage_main(run)
