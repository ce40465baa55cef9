"""Parallel training written from scratch on torch.distributed: data parallel (`ddp`: bucketed all-reduce from
gradient hooks), Megatron tensor parallel (`tensor`: f/g, column- and row-parallel layers) and pipelines
(`pipeline`: GPipe and 1F1B, simulated and run). Process groups for them come from `llmlab.dist.Grid`."""
