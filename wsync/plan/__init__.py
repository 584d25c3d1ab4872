"""The systems model: what a weight sync costs and how an RL loop should be laid out.

Pure functions over published model configs (`models`), counted into parameters
and bytes (`params`), LoRA adapter sizes (`lora`), sync time per link and codec
(`transfer`), an RL-loop simulator (`loop`, `sim`), layout sweeps (`sweep`) and
sandbox pool sizing (`sandboxes`), and the sharded layouts and routing plans of
catalog models (`reshard`). Nothing here imports torch or matplotlib at
module level; `wsync plan ...` is the command line.
"""
