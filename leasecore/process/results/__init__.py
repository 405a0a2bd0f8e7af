"""What a child's exit means to Conductor: the task result under the native protocol
(``task_result``) and conductor-cli's stdio contract (``stdio_protocol``), with what both say
alike (``reasons``). Pure.
"""
