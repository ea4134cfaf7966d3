"""Jinja chat templates for the chat-format families, as ``tokenizer.chat_template`` text.

Installed on the tokenizers this project builds offline (``lopd_jax.chat.tokenizers``) so that
``tokenizer.apply_chat_template`` exists for them and the hand-written renderers in
``lopd_jax.chat.qwen3`` / ``lopd_jax.chat.olmo3`` can be checked against it.
``QWEN3_CHAT_TEMPLATE`` is Qwen3's hybrid-thinking template and ``OLMO3_CHAT_TEMPLATE``
Olmo-3-7B-Instruct's, both reconstructed from published copies of the checkpoints'
``tokenizer_config.json``. Runs with a real checkpoint (``model.hf_path``,
``model.chat_template=auto``) use the checkpoint's own template; these serve tokenizer-less tiny
runs, and tests/chat/test_chat_template_parity.py checks the Qwen3 one against the official text.
"""

QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

OLMO3_DEFAULT_SYSTEM = "You are a helpful function-calling AI assistant. "
OLMO3_NO_FUNCTIONS = "You do not currently have access to any functions. <functions></functions>"
OLMO3_WITH_FUNCTIONS = (
    "You are provided with function signatures within <functions></functions> XML tags. "
    "You may call one or more functions to assist with the user query. Output any function "
    "calls within <function_calls></function_calls> XML tags. Do not make assumptions about "
    "what values to plug into functions."
)

OLMO3_CHAT_TEMPLATE = (
    "{%- set has_system = messages|selectattr('role', 'equalto', 'system')|list|length > 0 -%}"
    "{%- if not has_system -%}"
    "{{- '<|im_start|>system\\n" + OLMO3_DEFAULT_SYSTEM + "' -}}"
    "{%- if tools is none or (tools | length) == 0 -%}"
    "{{- '" + OLMO3_NO_FUNCTIONS + "<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '" + OLMO3_WITH_FUNCTIONS + "' -}}"
    "{{- '<functions>' -}}{{- tools | tojson -}}{{- '</functions><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + message['content'] -}}"
    "{%- if tools is not none -%}"
    "{{- '<functions>' -}}{{- tools | tojson -}}{{- '</functions>' -}}"
    "{%- elif message.get('functions', none) is not none -%}"
    "{{- ' <functions>' + message['functions'] + '</functions>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.get('content', none) is not none -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message.get('function_calls', none) is not none -%}"
    "{{- '<function_calls>' + message['function_calls'] + '</function_calls>' -}}"
    "{%- elif message.get('tool_calls', none) is not none -%}"
    "{{- '<function_calls>' -}}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- if tool_call is mapping and tool_call.get('function', none) is not none -%}"
    "{%- set args = tool_call['function']['arguments'] -%}"
    "{%- set ns = namespace(arguments_list=[]) -%}"
    "{%- for key, value in args.items() -%}"
    "{%- set ns.arguments_list = ns.arguments_list + [key ~ '=' ~ (value | tojson)] -%}"
    "{%- endfor -%}"
    "{%- set arguments = ns.arguments_list | join(', ') -%}"
    "{{- tool_call['function']['name'] + '(' + arguments + ')' -}}"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}"
    "{%- else -%}{{- tool_call -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '</function_calls>' -}}"
    "{%- endif -%}"
    "{%- if not loop.last -%}{{- '<|im_end|>' + '\\n' -}}{%- else -%}{{- eos_token -}}{%- endif -%}"
    "{%- elif message['role'] == 'environment' or message['role'] == 'tool' -%}"
    "{{- '<|im_start|>environment\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- if loop.last and add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
