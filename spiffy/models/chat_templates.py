"""The chat templates of the tiny checkpoints' tokenizers, one per family style (a family's registry entry,
:mod:`spiffy.models.registry`, names its template).

* :data:`LLADA_CHAT_TEMPLATE`: Llama-3 style (``<|start_header_id|>role<|end_header_id|>``, turns end with
  ``<|eot_id|>``), as LLaDA-8B-Instruct's tokenizer.
* :data:`LLAMA3_CHAT_TEMPLATE`: the same format, for Llama targets; :data:`MISTRAL_CHAT_TEMPLATE`: ``[INST] ... [/INST]``.
* :data:`CHATML_TEMPLATE`: ChatML (``<|im_start|>role``, turns end with ``<|im_end|>``), as SDAR and Qwen3.
* :data:`DREAM_CHAT_TEMPLATE`: ChatML with Dream's default system prompt.
* :data:`LING_CHAT_TEMPLATE`: Ling 2.0 style (``<role>ROLE</role>`` with ``HUMAN`` for the user, turns end with
  ``<|role_end|>``), as LLaDA-MoE's and LLaDA2's tokenizers.
"""

from __future__ import annotations

LLADA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Llama 3's chat format is LLaDA's (LLaDA-8B-Instruct kept the Llama 3 tokenizer)
LLAMA3_CHAT_TEMPLATE = LLADA_CHAT_TEMPLATE

MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

DREAM_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}" + CHATML_TEMPLATE
)

#: Ling-style turns (LLaDA-MoE shares the Ling tokenizer): ``<role>ROLE</role>content<|role_end|>``, user = HUMAN
__all__ = [
    "CHATML_TEMPLATE", "DREAM_CHAT_TEMPLATE", "LLADA_CHAT_TEMPLATE", "LING_CHAT_TEMPLATE", "LLAMA3_CHAT_TEMPLATE",
    "MISTRAL_CHAT_TEMPLATE",
]

LING_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set role = 'HUMAN' if message['role'] == 'user' else message['role'] | upper %}"
    "{{ '<role>' + role + '</role>' + message['content'] + '<|role_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}"
)
