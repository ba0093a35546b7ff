"""Training prompts: the synthetic arithmetic task and prompt sets from files or the HF hub.

`tasks` (ArithTask, arith_reward), `records` (the generic row loader shared with benchmarks) and
`datasets` (PromptSet, built from the `data` config group) -- import from those modules.
"""
