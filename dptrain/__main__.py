from dptrain.cli import entry

entry()
