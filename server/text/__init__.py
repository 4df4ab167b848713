"""The served model's text: the front-end tokenizer (:mod:`.tokenizer`, the GGUF loaded
``vocab_only``), incremental detokenizing with stop strings (:mod:`.detokenizer`) and the chat
template (:mod:`.chat_template`)."""
