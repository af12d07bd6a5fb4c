{{/*
Ports of the picker. They are fixed: gateways and the upstream charts expect
ext_proc on 9002 and health on 9003, and the probes, Service and
InferencePool below must agree on them.
*/}}
{{- define "tally.grpcPort" -}}9002{{- end -}}
{{- define "tally.grpcHealthPort" -}}9003{{- end -}}
{{- define "tally.metricsPort" -}}9090{{- end -}}
{{- define "tally.peerPort" -}}9004{{- end -}}
{{- define "tally.peerCertDir" -}}/etc/tally/peer-tls{{- end -}}
{{- define "tally.configDir" -}}/config{{- end -}}
{{- define "tally.configKey" -}}picker.yaml{{- end -}}

{{/*
The pool's name; every other name derives from it.
*/}}
{{- define "tally.poolName" -}}
{{- required "inferencePool.name is required: the name of the InferencePool this picker serves, e.g. --set inferencePool.name=llama" .Values.inferencePool.name -}}
{{- end -}}

{{/*
Name of the picker's Deployment, Service and (by default) ServiceAccount.
*/}}
{{- define "tally.fullname" -}}
{{- printf "%s-epp" (include "tally.poolName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tally.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tally.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false: the existing ServiceAccount the picker runs as" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The pod's termination grace: room for the drain (delay, then grace) and for
the picker's own exit.
*/}}
{{- define "tally.terminationGracePeriodSeconds" -}}
{{- $drain := add .Values.picker.shutdown.delaySeconds .Values.picker.shutdown.graceSeconds -}}
{{- if kindIs "invalid" .Values.picker.terminationGracePeriodSeconds -}}
{{- add $drain 15 -}}
{{- else if le (int .Values.picker.terminationGracePeriodSeconds) (int $drain) -}}
{{- fail (printf "picker.terminationGracePeriodSeconds (%d) must be above picker.shutdown.delaySeconds + picker.shutdown.graceSeconds (%d): the kubelet would kill the picker while streams drain" (int .Values.picker.terminationGracePeriodSeconds) (int $drain)) -}}
{{- else -}}
{{- .Values.picker.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/*
Cluster-scoped names carry the namespace: two releases of one pool name in
different namespaces must not share them.
*/}}
{{- define "tally.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "tally.fullname" .) -}}
{{- end -}}

{{- define "tally.metricsReaderName" -}}
{{- printf "%s-metrics-reader" (include "tally.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tally.leaderElection" -}}
{{- if gt (int .Values.picker.replicas) 1 -}}true{{- end -}}
{{- end -}}

{{/*
Active-active replicas: more than one, with peering on. Without it the
replicas are warm standbys and only the leader is ready.
*/}}
{{- define "tally.peering" -}}
{{- if and (include "tally.leaderElection" .) .Values.picker.peer.enabled -}}true{{- end -}}
{{- end -}}

{{/*
--peer-selector: the picker pods' selector labels as k=v,k2=v2, sorted, so
that a replica finds exactly the pods of its own release.
*/}}
{{- define "tally.peerSelector" -}}
{{- $labels := include "tally.selectorLabels" . | fromYaml -}}
{{- $pairs := list -}}
{{- range $k := keys $labels | sortAlpha -}}
{{- $pairs = append $pairs (printf "%s=%s" $k (get $labels $k)) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/*
The Secret holding the peers' ca.crt, tls.crt and tls.key.
*/}}
{{- define "tally.peerSecretName" -}}
{{- default (printf "%s-peer-tls" (include "tally.fullname" .)) .Values.picker.peer.existingSecret -}}
{{- end -}}

{{- define "tally.selectorLabels" -}}
app.kubernetes.io/name: tally
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end -}}

{{- define "tally.labels" -}}
{{ include "tally.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
tally.tallyepp.io/pool: {{ include "tally.poolName" . }}
{{- end -}}

{{- define "tally.image" -}}
{{- printf "%s:%s" .Values.picker.image.repository (default .Chart.AppVersion .Values.picker.image.tag) -}}
{{- end -}}

{{/*
Checks that span several values, which values.schema.json cannot say clearly.
Rendered (to nothing) by every template that needs them.
*/}}
{{- define "tally.validate" -}}
{{- if .Values.inferencePool.create -}}
{{- if not .Values.inferencePool.modelServers.matchLabels -}}
{{- fail "inferencePool.modelServers.matchLabels is required when inferencePool.create is true: the labels of the model server pods, e.g. --set inferencePool.modelServers.matchLabels.app=vllm-llama" -}}
{{- end -}}
{{- if not .Values.inferencePool.targetPorts -}}
{{- fail "inferencePool.targetPorts is required when inferencePool.create is true: the ports the model servers serve on, e.g. --set inferencePool.targetPorts[0].number=8000" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.httpRoute.create (not .Values.httpRoute.gateway.name) -}}
{{- fail "httpRoute.gateway.name is required when httpRoute.create is true: the Gateway the route attaches to" -}}
{{- end -}}
{{- with .Values.picker.leaderElection -}}
{{- if le (int .leaseDurationSeconds) (int .renewDeadlineSeconds) -}}
{{- fail (printf "picker.leaderElection.leaseDurationSeconds (%d) must be more than renewDeadlineSeconds (%d)" (int .leaseDurationSeconds) (int .renewDeadlineSeconds)) -}}
{{- end -}}
{{- if le (mul (int .renewDeadlineSeconds) 10) (mul (int .retryPeriodSeconds) 12) -}}
{{- fail (printf "picker.leaderElection.renewDeadlineSeconds (%d) must be more than 1.2 times retryPeriodSeconds (%d)" (int .renewDeadlineSeconds) (int .retryPeriodSeconds)) -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.provider.name "gke" -}}
{{- if .Values.httpRoute.requestTimeout -}}
{{- fail (printf "httpRoute.requestTimeout (%s) must be empty with provider.name gke: GKE's gateway does not take HTTPRoute timeouts; set provider.gke.timeoutSeconds (the GCPBackendPolicy's timeoutSec) instead" .Values.httpRoute.requestTimeout) -}}
{{- end -}}
{{- if not .Values.inferencePool.targetPorts -}}
{{- fail "inferencePool.targetPorts is required with provider.name gke: the HealthCheckPolicy checks the model servers on the first one" -}}
{{- end -}}
{{- end -}}
{{- $ownEnv := list "NAMESPACE" "POD_NAME" -}}
{{- if include "tally.peering" . -}}
{{- $ownEnv = append $ownEnv "POD_IP" -}}
{{- end -}}
{{- if dig "limits" "memory" "" .Values.picker.resources -}}
{{- $ownEnv = append $ownEnv "GOMEMLIMIT" -}}
{{- end -}}
{{- range .Values.picker.env -}}
{{- if has .name $ownEnv -}}
{{- fail (printf "picker.env sets %s, which the chart sets itself (%s)" .name (join ", " $ownEnv)) -}}
{{- end -}}
{{- end -}}
{{- $ownVolumes := list "config" "tmp" -}}
{{- if include "tally.peering" . -}}
{{- $ownVolumes = append $ownVolumes "peer-tls" -}}
{{- end -}}
{{- range .Values.picker.extraVolumes -}}
{{- if has .name $ownVolumes -}}
{{- fail (printf "picker.extraVolumes names a volume %q, a name the chart uses itself (%s)" .name (join ", " $ownVolumes)) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.podDisruptionBudget.create (eq (toString .Values.podDisruptionBudget.minAvailable) "") (eq (toString .Values.podDisruptionBudget.maxUnavailable) "") -}}
{{- fail "podDisruptionBudget: set minAvailable or maxUnavailable when podDisruptionBudget.create is true" -}}
{{- end -}}
{{- end -}}
