"""The served model's text: incremental detokenizing with stop strings (:mod:`.detokenizer`) and
the chat template (:mod:`.chat_template`), over the front-end tokenizer that lives with the rest
of llama.cpp (:mod:`engine.llama.tokenizer`)."""
