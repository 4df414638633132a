"""Integrations with training engines that keep gradients to themselves (DeepSpeed ZeRO). Imported lazily: importing
`gnmr_hf` never imports an engine."""
