"""tools/deepspec_reference.py's code: DeepSpec's DSpark trained on protocol 2's data and scored by dstrain's evaluator.

checkout   the DeepSpec checkout verified, imported, its DSpark config read
settings   DeepSpec's settings kept and those matched to protocol 2; how the execution differs from DeepSpec's
attention  the dense attention registered with transformers (DeepSpec's BlockMask evaluated on the CPU)
drafter    DeepSpecDrafter (dstrain's drafter contract over DeepSpec's model) and the model built at the target's sizes
parity     the adapter checked against DeepSpec's own forward and evaluator path
training   DeepSpec's step over the dstrain run's samples and features; resumable checkpoints
plan       sizes, recipe and clock stages without weights; --dry-run
run        the real run: training, evaluation, the record
"""
