"""Prompts whose greedy replies on the bundled model have a known shape (not known text: a reply
depends on the CPU's kernels), for the tests that need such replies."""

# Prompts whose greedy replies are in scripts of two or three tokens a character (CJK, emoji).
MULTIBYTE_PROMPTS = ("Say hello in Chinese.", "Say hello in Japanese.", "Reply with only an emoji.")
EMOJI_PROMPT = "Reply with only an emoji."
# A prompt whose greedy reply starts with words of several letters, some of them one token each.
GREETING_PROMPT = "Write a greeting in Chinese, Japanese and as an emoji."
