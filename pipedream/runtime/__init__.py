"""One rank's pipeline at run time: the engine that composes it, the stage that runs its layers, the
executor that walks its action list, point-to-point communication, process groups, and the flush
(``runner``) and asynchronous (``async_runner``) step loops."""
