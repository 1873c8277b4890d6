"""Chat templates that read a message's content only as a list of parts, for the tests of
`hybridflow.data.chat.render_messages`, written here from the published formats (not copied).

`SMOLVLM` renders what SmolVLM's and Idefics3's published template renders: `<|im_start|>`, then each message's role
capitalized, `:` when its content opens with an image part and `: ` otherwise, each text part's text and `<image>` for
each image part, `<end_of_utterance>` and a newline; `Assistant:` as the generation prompt. Given a string content it
walks the string's characters, none of which has a type, and renders nothing of it. `GEMMA3_PARTS` is Gemma 3's
format read the same way.
"""

SMOLVLM = (
    "<|im_start|>"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}{{ ':' if message['content'][0]['type'] == 'image' else ': ' }}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# Gemma 3's turns with its published template's text for an image part (`<start_of_image>`), reading parts only (the
# published template reads strings too): a family whose image part is written as a mark other than verl's `<image>`
GEMMA3_PARTS = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% endif %}"
    "{% endfor %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
