package api

import (
	"reflect"
	"testing"

	"github.com/spacedev/space/internal/guest/wire"
)

// TestFileTypesMatchAgentWire keeps the public file types and the agent's wire types in
// step. The api role passes these bodies through between client and agent unchanged
// (it re-encodes requests after validating them), so the two must have the same JSON
// shape; they stay separate types because the agent protocol is versioned on its own
// (an agent inside an old snapshot keeps talking to a newer host).
func TestFileTypesMatchAgentWire(t *testing.T) {
	pairs := []struct{ public, wire any }{
		{FileInfo{}, wire.EntryInfo{}},
		{MkdirRequest{}, wire.MkdirRequest{}},
		{MoveRequest{}, wire.MoveRequest{}},
		{WatchEvent{}, wire.WatchEvent{}},
	}
	for _, p := range pairs {
		pt, wt := reflect.TypeOf(p.public), reflect.TypeOf(p.wire)
		if pt.NumField() != wt.NumField() {
			t.Errorf("%v has %d fields, %v %d", pt, pt.NumField(), wt, wt.NumField())
			continue
		}
		for i := range pt.NumField() {
			pf, wf := pt.Field(i), wt.Field(i)
			if pf.Name != wf.Name || pf.Type != wf.Type || pf.Tag.Get("json") != wf.Tag.Get("json") {
				t.Errorf("%v.%s (%v, json %q) differs from %v.%s (%v, json %q)",
					pt, pf.Name, pf.Type, pf.Tag.Get("json"), wt, wf.Name, wf.Type, wf.Tag.Get("json"))
			}
		}
	}
}
