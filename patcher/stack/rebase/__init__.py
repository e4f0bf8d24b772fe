"""rebase: the rebase op kind (carry) and its summary of what happened to every patch (summary)."""
