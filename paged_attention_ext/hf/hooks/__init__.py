"""The places where the integration must reach into transformers' private code.

One module per transformers behaviour, each installed by :mod:`paged_attention_ext.hf` and
each with a test (tests/test_hf_hooks.py) that fails when transformers changes what it
relies on. Everything else in ``hf/`` uses transformers' extension points only
(AttentionInterface, AttentionMaskInterface, the Cache API).
"""
