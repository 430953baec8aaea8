// Package agentlink is the gVisor agent's transport since 2026-12-06: the agent
// connects to a unix socket the node listens on (in the instance's run directory),
// instead of listening on one of its own. Under gVisor a socket the agent binds on a
// gofer mount needs runsc --host-uds=create, which is global: every socket a program
// binds on the sandbox's disk becomes a host socket, and a checkpoint cannot save one
// (the sandbox could not be suspended, cloned or snapshotted while one existed). An
// agent that only connects lets runsc run with --host-uds=open, where such sockets stay
// in the Sentry and are saved like any other state.
//
// Every HTTP connection is a connection of its own, dialed by the agent, so the data
// path is the same plain unix socket as a listening agent's (a yamux session over one
// connection was measured a fifth slower for output: docs/benchmarks.md, twentieth
// pass). The node asks for them over a control connection:
//
//	agent → node   "space-agent control <key>\n"  opens the control connection,
//	                                              presenting the key it was given
//	                                              ("-": none yet)
//	node → agent   "key <64 hex digits>\n"        the agent's key
//	node → agent   "dial\n"                       make one data connection
//	node → agent   "ping\n" / agent → node "pong\n"
//	agent → node   "space-agent data <key>\n"     opens a data connection, which then
//	                                              carries one HTTP/1.1 connection
//	                                              (the node is the client)
//
// The node keeps one data connection made ahead (asked for when the control
// connection is taken, and again whenever one is handed out), so a new HTTP connection
// costs no round trip into the sandbox; the agent hands such a connection to its HTTP
// server only with its first byte, so that the server's timeouts count from the
// request.
//
// One control connection holds the agent's place at a time. After a start or a restore
// the agent connects before any user process runs (it thaws them once connected), so
// the first control connection is the agent's; it is given a new key. A later one is
// closed unanswered while the one holding the place answers a ping. When it does not
// (the agent's connection broke, or this is a new node process), only a newcomer that
// presents the agent's key takes the place: the key the agent confirmed by using it on
// a data connection, which the node saves outside the sandbox (Keys) for its next
// process. A process of the sandbox cannot learn it (it lives in the agent's memory,
// and gVisor refuses root a ptrace of PID 1), so it cannot stand in for the agent,
// neither while it runs nor after a restart of the node. Until 2026-12-07 the first
// newcomer took the place; an agent from before then presents no key and is still
// taken so. A data connection needs the key too.
//
// Hand-rolled on purpose: the protocol is five lines, and the libraries made for
// multiplexing (yamux, HTTP/2) are what the measurement above rejected.
package agentlink

import (
	"errors"
	"fmt"
	"io"
	"time"
)

// The protocol's lines (without their newline).
const (
	helloControl = "space-agent control"
	noKey        = "-" // presented by an agent that has no key yet
	helloData    = "space-agent data "
	keyPrefix    = "key "
	reqDial      = "dial"
	reqPing      = "ping"
	ansPong      = "pong"
	// maxLine bounds every line either end reads.
	maxLine = 128
)

// Bounds.
const (
	// helloTimeout bounds the agent's wait for the key, and every write.
	helloTimeout = 5 * time.Second
	// greetTimeout bounds the wait for a new connection's first line; maxPending is how
	// many connections may wait for theirs at once.
	greetTimeout = 2 * time.Second
	maxPending   = 32
	// pingTimeout is how long the control connection that holds the place has to
	// answer when another control connection arrives; an answer counts for
	// answerFresh (a process of the sandbox that connects in a loop makes the agent
	// answer a ping at most once a second, and the node log one line a minute).
	pingTimeout = time.Second
	answerFresh = time.Second
	refuseLog   = time.Minute
	// redialEvery is how often a Dial that still waits asks for a data connection
	// again (one the agent made may have been closed as the oldest waiting greeting).
	redialEvery = 500 * time.Millisecond
	// spareConns bounds data connections that arrived and wait for a Dial: the one
	// made ahead, and those of Dials that gave up before theirs came.
	spareConns = 64
	// settled is how long a control connection must have lasted for the agent to make
	// the next one at once; otherwise it pauses, doubling from 10 ms up to a second.
	settled = time.Second
)

// ErrClosed is what Dial returns once the Host is closed.
var ErrClosed = errors.New("the agent's link is closed")

// readLine reads one line of at most maxLine bytes, a byte at a time: nothing after
// the newline is consumed (on a data connection the HTTP exchange follows).
func readLine(r io.Reader) (string, error) {
	var b [1]byte
	var line []byte
	for len(line) <= maxLine {
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return "", err
		}
		if b[0] == '\n' {
			return string(line), nil
		}
		line = append(line, b[0])
	}
	return "", fmt.Errorf("line longer than %d bytes", maxLine)
}
