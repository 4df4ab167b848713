"""Tool calling (OpenAI's ``tools``): what a request asks (``spec``), how a chat template's
model writes a call (``formats``), reading calls out of the model's text as it streams
(``parser``) and the grammar that constrains what the model may call (``grammar``). The front
ends' shared path (``server/generation/``) uses them; docs/api.md "Tool calling" is the manual."""
