"""Expert parallelism: moving tokens to the ranks of their experts and back (Megatron's token
dispatchers). It moves activations between ranks and knows no model (docs/parallelism.md)."""
