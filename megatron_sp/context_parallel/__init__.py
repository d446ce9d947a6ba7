"""Context parallelism: the sequence of one sample split over the ranks of a CP group.

    split.py    which global token positions each CP rank holds (contiguous for Ulysses, zigzag for the
                ring), and document ids from a document mask
    ulysses.py  all-to-all sequence <-> heads around the attention core (DeepSpeed-Ulysses)
    ring.py     key/value blocks passed around the CP ring, blockwise attention merged by log-sum-exp
Everything outside attention is per token, so it runs unchanged on the rank's tokens; the loss is
averaged over the whole sequence (models/lm_head.py) and gradients are summed over CP
(tensor_parallel/partial_grads.py; in training, with the data-parallel reduction of distributed/grad_sync.py).
"""
