"""Parallel training written from scratch on torch.distributed: data parallel (`ddp`: bucketed all-reduce from
gradient hooks), Megatron tensor parallel (`tensor`: f/g, column- and row-parallel layers), sequence parallel
(`sequence`: Megatron-SP's all-gather/reduce-scatter along the tokens between them), context parallel
(`context`: ring attention with the zig-zag layout) and pipelines
(`pipeline`: GPipe, 1F1B and interleaved 1F1B run on ranks; `schedules`: those and the zero-bubble ZB-H1 as data,
simulated). Process groups for them come from `llmlab.dist.Grid`."""
