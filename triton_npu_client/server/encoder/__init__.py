"""The sentence encoder: a BERT in plain torch, and the tokenizer and encoder models Triton runs (all-MiniLM-L6-v2).

``_bert`` (the encoder, mean pooling, normalisation) and ``_encoder`` (:class:`TokenizerModel`,
:class:`EncoderModel`, the packaged checkpoint), what ``server_models/minilm_*/1/model.py`` run.

An engine imports the toolkit (``triton_npu_client.server``'s own modules) and itself, never another engine
(tests/test_layers.py). Nothing is imported here: names load from ``triton_npu_client.server`` on first use.
"""
