"""What every stage shares: the config sections and errors (config, errors), atomic I/O and output ownership (io,
outputs, stage), the records and the machine's facts (records, hardware), sampling, tracking, the pinned assets, the
target model and its helpers (models/) and the data (data/). Each stage depends on this folder as a whole
(dvc.yaml): what nearly every stage reads is one dependency, not twenty files listed by hand."""
