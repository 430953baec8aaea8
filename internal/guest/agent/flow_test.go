package agent

import "testing"

// TestFlowWindow: the window of a pipe in flow follows the writer. A writer that fills
// the whole pipe within every window (as `head -c 1G` does) keeps the window at its
// shortest: each full read is followed at once by one that takes what came meanwhile,
// which says nothing of the window. Before, that follow-up counted as a short read and
// doubled the window up to pumpMaxWindow, and the writer waited on a full pipe. A slow
// writer lets the window grow to pumpMaxWindow; one near pumpTarget leaves it.
func TestFlowWindow(t *testing.T) {
	fast := &flow{on: true, window: pumpWindow}
	buf := pumpBuf
	for i := range 200 {
		n := pumpPipeSize // the pipe was full after the window
		if i == 0 {
			n = buf // the first read, into the small buffer, is full too
		}
		if !fast.step(n, buf) {
			t.Fatalf("read %d filled the buffer and the pump did not read on at once", i)
		}
		buf = pumpPipeSize
		if fast.step(16<<10, buf) { // what came in the instants since
			t.Fatal("a short read was taken for a full one")
		}
		if fast.window != pumpWindow {
			t.Fatalf("after %d full pipes the window is %v, want %v", i+1, fast.window, pumpWindow)
		}
	}
	slow := &flow{on: true, window: pumpWindow}
	for range 10 {
		slow.step(4<<10, pumpPipeSize)
	}
	if slow.window != pumpMaxWindow {
		t.Fatalf("a slow writer's window: %v, want %v", slow.window, pumpMaxWindow)
	}
	steady := &flow{on: true, window: 2 * pumpWindow}
	for range 10 {
		steady.step(pumpTarget, pumpPipeSize)
	}
	if steady.window != 2*pumpWindow {
		t.Fatalf("a writer at the target moved the window to %v", steady.window)
	}
	// A writer that fills the pipe after the window had grown: it shrinks back.
	for range 10 {
		slow.step(pumpPipeSize, pumpPipeSize)
		slow.step(8<<10, pumpPipeSize)
	}
	if slow.window != pumpWindow {
		t.Fatalf("after full pipes the window is %v, want %v", slow.window, pumpWindow)
	}
}
