package node_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/spacetest"
)

// TestSamplesLeaveIdleSandboxesAlone: with a runtime that reads CPU time on the host,
// an idle sandbox is sampled without asking its agent once the agent has answered, and
// a sandbox that burnt CPU is asked again, with its CPU use from the host's count.
func TestSamplesLeaveIdleSandboxesAlone(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{HostCPU: true})
	reg := prometheus.NewRegistry()
	s.Node.RegisterMetrics(reg)
	count := func(source string) float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "space_node_metric_samples_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "source" && l.GetValue() == source {
						return m.GetCounter().GetValue()
					}
				}
			}
		}
		t.Fatalf("no space_node_metric_samples_total{source=%q}", source)
		return 0
	}
	sb := s.Create(api.CreateSandboxRequest{CPU: 1, MemoryMB: 256})
	s.Eventually(40*time.Second, "two samples from the host alone", func() bool { return count("host") >= 2 })
	// The first sample asks (nothing to compare with yet); an idle agent is left alone
	// after that, mostly: the fake runtime counts CPU in 10 ms clock ticks, and a tick
	// or two of the agent's own (its timers, a loaded host) can make a round look busy.
	if a, h := count("agent"), count("host"); a < 1 || a > h+1 {
		t.Fatalf("idle sandbox: %v samples from its agent, %v from the host", a, h)
	}
	// The counters move as each sample is taken; a round's samples are stored together
	// after the round.
	var m *api.MetricList
	var err error
	s.Eventually(10*time.Second, "three stored samples", func() bool {
		m, err = s.C.SandboxMetrics(ctx(t), sb.ID, time.Time{}, time.Time{})
		return err == nil && len(m.Samples) >= 3
	})
	for _, x := range m.Samples {
		if x.MemUsed <= 0 || x.MemUsed > x.MemTotal || x.CPUUsedPct < 0 || x.CPUUsedPct > 100 {
			t.Fatalf("sample: %+v", x)
		}
	}
	asked := count("agent")
	// About a second of CPU in a 5 s round: well over the idle threshold. (The fake
	// agent's own CPU figure is the whole host's, so only samples from the rounds
	// since count.)
	burnt := time.Now().UTC().Truncate(time.Second)
	run(t, s, sb.ID, `i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done`)
	s.Eventually(30*time.Second, "the agent asked, and a sample of the busy round", func() bool {
		if count("agent") <= asked {
			return false
		}
		m, err = s.C.SandboxMetrics(ctx(t), sb.ID, burnt, time.Time{})
		if err != nil {
			return false
		}
		for _, x := range m.Samples {
			if x.CPUUsedPct >= 5 {
				return true
			}
		}
		return false
	})
}
