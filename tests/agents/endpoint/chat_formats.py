"""Tokenizers in the chat formats of four model families, built offline for the token-exact tests.

Each is the tiny byte-level BPE tokenizer with the family's special tokens and a chat template written
here that renders what the family's template renders for the cases the tests use (written from the
formats, not copied):
- Qwen2.5: a default system message; tools declared in the system message; assistant tool calls as
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`; tool results grouped in one user turn.
- Qwen3: no default system message; `<think>` reasoning kept only on assistant turns after the last user
  query (always on the last one); tool calls and results as Qwen2.5.
- Llama 3.1: `<|begin_of_text|>`, header ids, a system header with the knowledge-cutoff lines, contents
  trimmed, `<|eot_id|>` ending each turn.
- SmolLM2: ChatML with SmolLM's default system message.
"""

from __future__ import annotations

from hybridflow.utils.tiny_model import build_tokenizer

_TOOLS_TEXT = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
               "with function signatures within <tools></tools> XML tags:\n<tools>"
               "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a "
               "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_CALLS = ('{% for c in m.tool_calls %}{% if not loop.first or content %}\n{% endif %}<tool_call>\n{"name": "'
          '{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}')
_TOOL_RESULT = ("{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
                "\n<tool_response>\n{{ m.content }}\n</tool_response>"
                "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}")

QWEN25 = (
    "{% set default = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}{% else %}"
    "{% set system = default %}{% endif %}"
    "<|im_start|>system\n{{ system }}{% if tools %}" + _TOOLS_TEXT + "{% endif %}<|im_end|>\n"
    "{% for m in messages %}{% set content = m.content %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{% if content %}\n{{ content }}{% endif %}"
    "{% if m.tool_calls %}" + _CALLS.replace("{% if not loop.first or content %}\n{% endif %}", "\n") +
    "{% endif %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}" + _TOOL_RESULT +
    "{% else %}<|im_start|>{{ m.role }}\n{{ content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

QWEN3 = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    + _TOOLS_TEXT.replace("\n\n# Tools", "{% if messages[0].role == 'system' %}\n\n{% endif %}# Tools", 1)
    + "<|im_end|>\n{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% set ns = namespace(last_query=messages | length - 1, searching=true) %}"
    "{% for m in messages[::-1] %}{% set i = messages | length - 1 - loop.index0 %}"
    "{% if ns.searching and m.role == 'user' and not m.content.startswith('<tool_response>') %}"
    "{% set ns.searching = false %}{% set ns.last_query = i %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m.content %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "<think>\n{{ reasoning.strip('\n') }}\n</think>\n\n{{ content.lstrip('\n') }}"
    "{% else %}{{ content }}{% endif %}"
    "{% if m.tool_calls %}" + _CALLS + "{% endif %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}" + _TOOL_RESULT +
    "{% else %}<|im_start|>{{ m.role }}\n{{ content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

LLAMA3 = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% endif %}<|eot_id|>"
    "{% for m in messages %}{% if not (m.role == 'system' and loop.first) %}"
    "<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Hugging Face renders templates with trim_blocks: a newline right after a block tag is dropped, so those are
# written as expressions (as the families' own templates do)
FORMATS = {name: template.replace("%}\n", "%}{{ '\\n' }}") for name, template in
           {"qwen2.5": QWEN25, "qwen3": QWEN3, "llama3": LLAMA3, "smollm2": SMOLLM2}.items()}
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def chat_tokenizer(family: str):
    """The tiny tokenizer in `family`'s chat format (see the module docstring); eos ends a model turn."""
    tok = build_tokenizer(["<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"6*7\"}}",
                           "What is 6 * 7? The answer is 42. I should compute it."] * 20, vocab_size=400)
    tok.chat_template = FORMATS[family]
    if family == "llama3":
        tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIAL})
        tok.eos_token = "<|eot_id|>"
    else:  # added (not special) tokens of the Qwen vocabularies
        tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"])
    return tok
