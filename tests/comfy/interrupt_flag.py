"""ComfyUI's interrupt flag as the pack reads it (interrupts.InterruptFlag), for the tests."""


class Interrupted(Exception):
    """What ComfyUI raises at an interrupt (its InterruptProcessingException)."""


class Flag:
    def __init__(self):
        self.raised = False

    def requested(self):
        return self.raised

    def throw(self):
        self.raised = False
        raise Interrupted()
