"""The systems model: what a weight sync costs and how an RL loop should be laid out.

Pure functions over published model configs (`models`), counted into parameters
and bytes (`params`), LoRA adapter sizes (`lora`), sync time per link and codec
(`transfer`), an RL-loop simulator (`loop`, `sim`), layout sweeps (`sweep`) and
sandbox pool sizing (`sandboxes`), the sharded layouts and routing plans of
catalog models (`reshard`), the published tables recomputed from their own
inputs (`published`, the figures in `published_tables`), and the measured
inputs the package ships (`measured`, data/measured.json). Nothing here imports
torch or matplotlib at module level; `wsync plan ...` is the command line.
"""
