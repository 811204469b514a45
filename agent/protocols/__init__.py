"""The tool protocols: how the policy calls the search tool and how its results are written back."""
