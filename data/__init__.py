"""The data a run reads: datasets as ms-swift reads them and the built-in tasks (``loading``), chat templates
(``chat``), images and other media by content key (``media``), Hub downloads in huggingface_hub's cache
(``hub``), the CPU-only torchvision workaround that VL processors need (``vl_compat``). Imports the
framework, the config, rewards (the columns they need) and schedulers (verifiers datasets); never an engine
or a stage."""
