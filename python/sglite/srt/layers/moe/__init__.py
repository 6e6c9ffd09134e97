"""Mixture-of-experts: routing (``topk``), the expert computation (``fused_moe_native``, ``fused_moe_triton``)
and the ``FusedMoE`` layer that shards experts over tensor- and expert-parallel ranks (``layer``)."""
