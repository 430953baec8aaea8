// Package codeinterp holds space's code interpreter server (server.py): the HTTP API
// of E2B's code interpreter SDKs (port 49999: /execute streaming NDJSON, /contexts),
// on Jupyter kernels for Python (ipykernel via jupyter_client) and a persistent bash
// for bash. The builtin template code-interpreter-v1 (package template) installs it
// and starts it with the sandbox; E2B's listener reaches it through the agent's port
// tunnels. It is Python because the kernels are: jupyter_client is the maintained
// client of the Jupyter protocol, and the template carries it as a Debian package.
package codeinterp

import _ "embed"

// Server is the server's source (a Python 3 program using only the standard library
// and Debian's python3-jupyter-client).
//
//go:embed server.py
var Server []byte

const (
	// Port is where the server listens inside the sandbox (E2B's JUPYTER_PORT).
	Port = 49999
	// Path is where templates install the server.
	Path = "/usr/local/lib/space/codeinterp/server.py"
)
