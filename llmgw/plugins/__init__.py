"""Built-in plugins, registered through the ``llmgw`` entry-point group like any third party's."""
