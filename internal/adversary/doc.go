// Package adversary is space's adversarial suite: each test is an attack that code in
// a sandbox (root inside included) or a tenant with an API key would try, run against
// a real `space serve` with gVisor sandboxes (package e2etest). While each attack runs,
// a neighbour sandbox runs a steady workload, and the suite checks that its exec p95 and
// the API's p95 stay within twice the quiet baseline measured first in the same run,
// and that the host's free disk never drops below the operator's reserve.
//
// The package has no code outside its tests; docs/security.md lists every guarantee
// and the test that proves it.
package adversary
