{{- define "huorn.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The name of the release's namespaced objects. */}}
{{- define "huorn.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of a cluster-scoped object of the release: (list . suffix). Releases of one name in
     two namespaces (one install per set of namespaces, docs/operator.md) must not share a
     ClusterRole or ClusterRoleBinding, so the name carries the release's namespace; a name over
     63 characters is cut and made unique again by a hash of the whole. */}}
{{- define "huorn.clusterName" -}}
{{- $ctx := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $base := printf "%s-%s" (include "huorn.fullname" $ctx) $ctx.Release.Namespace -}}
{{- if gt (len (printf "%s%s" $base $suffix)) 63 -}}
{{- $base = printf "%s-%s" ($base | trunc (int (sub 54 (len $suffix))) | trimSuffix "-") (sha256sum $base | trunc 8) -}}
{{- end -}}
{{- printf "%s%s" $base $suffix -}}
{{- end -}}

{{- define "huorn.labels" -}}
app.kubernetes.io/name: {{ include "huorn.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "huorn.selectorLabels" -}}
app.kubernetes.io/name: {{ include "huorn.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "huorn.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "huorn.fullname" .) .Values.serviceAccount.name -}}
{{- else if .Values.serviceAccount.name -}}
{{- .Values.serviceAccount.name -}}
{{- else -}}
{{- fail "serviceAccount.create=false needs serviceAccount.name: the ServiceAccount the operator runs as, which must exist in the release's namespace (left empty, the ClusterRole would be bound to the namespace's default ServiceAccount, so to every pod there that names none)" -}}
{{- end -}}
{{- end -}}

{{- define "huorn.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The pods of a job without spec.image run this: jobImage, else the operator's image with the
     CUDA build's tag suffix (jobImageSuffix): GPU jobs need a torch built for CUDA, which runs
     CPU jobs as well, while the operator itself needs none. */}}
{{- define "huorn.jobImage" -}}
{{- $image := include "huorn.image" . -}}
{{- $suffix := .Values.jobImageSuffix -}}
{{- if and $suffix (not (hasSuffix $suffix $image)) -}}{{- $image = printf "%s%s" $image $suffix -}}{{- end -}}
{{ .Values.jobImage | default $image }}
{{- end -}}

{{/* Guards on values that the schema alone cannot express (included by deployment.yaml). */}}
{{- define "huorn.checkValues" -}}
{{- /* The schema requires these already; without it (helm --skip-schema-validation) a value
     missing after `helm upgrade --reuse-values` from an older chart rendered `--autoscale-seconds=`
     (the operator exits 2) or silently ran GPU jobs on the CPU image (no jobImageSuffix). */ -}}
{{- range $key := list "jobImageSuffix" "resyncSeconds" "podStartSeconds" "replacementBackoffSeconds" "autoscaleSeconds" -}}
{{- if not (hasKey $.Values $key) -}}
{{- fail (printf "%s is unset: an upgrade with --reuse-values from an older chart keeps that chart's values, without the ones added since; upgrade with -f your-values.yaml or --reset-then-reuse-values" $key) -}}
{{- end -}}
{{- end -}}
{{- range $key := list "health" "metrics" -}}
{{- if not (hasKey (index $.Values $key | default dict) "port") -}}
{{- fail (printf "%s.port is unset: an upgrade with --reuse-values from an older chart keeps that chart's values, without the ones added since; upgrade with -f your-values.yaml or --reset-then-reuse-values" $key) -}}
{{- end -}}
{{- end -}}
{{- if eq (int .Values.metrics.port) (int .Values.health.port) -}}
{{- fail (printf "metrics.port and health.port are both %d: the operator serves /metrics and /healthz on separate ports (huorn operator exits 2 otherwise); give each its own" (int .Values.metrics.port)) -}}
{{- end -}}
{{- end -}}
