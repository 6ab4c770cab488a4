"""Stage `train@M`: see `specdistill.stages.train`. `python pipelines/train.py --help` lists the config.

Sweeps: `python pipelines/train.py -m draft=xs,s,m loss=fkl,rkl,jsd,tvd` (one W&B run per job, one group).
"""

from _entry import stage_main

from specdistill.stages.train import run

if __name__ == "__main__":
    stage_main(run)
