"""The chat engine: a GPT-2 decoder with a slot-indexed KV cache, its tokenizer, and the chat model Triton runs.

``_gpt2`` (the decoder and :class:`KVCache`), ``_chat`` (:class:`ChatEngine`: chat template, tokenizer, turns
decoded together on a :class:`~triton_npu_client.server.StepLoop`) and ``_chat_model`` (:class:`ChatModel`, what
``server_models/chat*/1/model.py`` run). The next decoder family, its chat templates and cache layouts go here too.

An engine imports the toolkit (``triton_npu_client.server``'s own modules) and itself, never another engine
(tests/test_layers.py). Nothing is imported here: names load from ``triton_npu_client.server`` on first use, and
importing a module of this folder loads no sibling it does not use.
"""
