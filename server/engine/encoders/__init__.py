"""Text encoders shared by families, one package each (a family passes its prompt template and
the layers it reads)."""
